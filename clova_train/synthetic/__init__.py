"""Synthetic data every tool draws on, below the runtime layer: rendered shapes and scenes with known labels, boxes
and masks (``shapes``), and the tiny Llama's pretraining documents (``skill_documents``, ``file_names``). Each tool's
own writer, in the format users bring (concept folders, VQA records, COCO scenes, masked concepts), lives in its
folder (``clova_train/tools/<name>/synthetic.py``), so everything goes through the real readers. No Lightning.
"""
