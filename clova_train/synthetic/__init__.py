"""Layer 2, synthetic data: rendered shapes with known labels, boxes and question/answer pairs.

Quickstarts, tests and benchmarks write their data with these generators in the same formats users bring
(concept folders, VQA records), so everything goes through the real readers. No Lightning.
"""
