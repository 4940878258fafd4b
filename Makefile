# Set-up and entry points. `make demo` and `make test` work from a fresh clone: they create .venv,
# install torch (pinned to the wheels this project is tested with), the package and its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_RUN := checkpoints/quickstart_clip
TINY_CLIP := checkpoints/models/tiny-clip
TINY_LLAMA := checkpoints/models/tiny-llama
TINY_BLIP := checkpoints/models/tiny-blip
VQA_RUN := checkpoints/quickstart_vqa
TINY_OWLVIT := checkpoints/models/tiny-owlvit
LOC_RUN := checkpoints/quickstart_loc
TINY_MASKFORMER := checkpoints/models/tiny-maskformer
SEG_RUN := checkpoints/quickstart_seg
TINY_SD := checkpoints/models/tiny-sd-inpaint
REPLACE_RUN := checkpoints/quickstart_replace

# The demos run ATen on its portable kernels, so that they print the documentation's figures on any x86 host: the tiny
# models are pretrained for minutes, and AVX2 or AVX-512 rounding builds other (equally good, not identical)
# models. The tests and benchmarks run on the host's own kernels (the learning tests assert effects over seeds
# that hold on either; tests/tools/test_*_learning.py).
DEMO_TARGETS := demo demo-vqa demo-loc demo-seg demo-replace demo-llm demo-controller demo-controller-joint demo-avis demo-hammr demo-loop
$(DEMO_TARGETS): export ATEN_CPU_CAPABILITY = default
# oneDNN below AMX: on an AMX host its bf16 attention asks ATen's portable kernels for VNNI packing and fails
$(DEMO_TARGETS): export ONEDNN_MAX_CPU_ISA ?= AVX512_CORE_FP16

.PHONY: demo demo-vqa demo-loc demo-seg demo-replace demo-llm demo-controller demo-controller-joint demo-avis demo-hammr demo-loop test test-learning test-fast install benchmark smoke-real gpu-check clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TINY_CLIP)/open_clip_config.json: | $(STAMP)
	$(BIN)/clova-train tiny-model clip $(TINY_CLIP) --pretrain-steps 200

demo: $(STAMP) $(TINY_CLIP)/open_clip_config.json
	$(BIN)/clova-train fit --config configs/quickstart/clip_prompt.yaml --model.init_args.on_existing_pool=overwrite
	$(BIN)/clova-train export $(DEMO_RUN) --output $(DEMO_RUN)/export
	$(BIN)/python -m clova_train.quickstart.demos.clip $(DEMO_RUN)/export
	$(BIN)/clova-train report $(DEMO_RUN)

# The VQA prompt tool (BLIP): fit on a tiny BLIP and synthetic shape questions, export, then serve held-out
# questions without Lightning (per-answer accuracy without prompts and with the pool; one JSON request too).
$(TINY_BLIP)/config.json: | $(STAMP)
	$(BIN)/clova-train tiny-model blip $(TINY_BLIP) --pretrain-steps 300

demo-vqa: $(STAMP) $(TINY_BLIP)/config.json
	$(BIN)/clova-train fit --config configs/quickstart/vqa_prompt.yaml --model.init_args.on_existing_pool=overwrite
	$(BIN)/clova-train export $(VQA_RUN) --output $(VQA_RUN)/export
	$(BIN)/python -m clova_train.quickstart.demos.vqa $(VQA_RUN)/export
	$(BIN)/clova-train report $(VQA_RUN)
	$(BIN)/clova-train serve $(VQA_RUN)/export --request '{"image": "checkpoints/data/synthetic_vqa/images/eval_orange_000.png", "question": "what colour is the circle?"}'

# The LOC prompt tool (OWL-ViT): fit on a tiny detector and synthetic COCO-format scenes, export, then serve
# held-out images without Lightning (detection rate without prompts, with the pool, with a random-prompt
# pool; a picture with the boxes drawn) and one JSON request.
$(TINY_OWLVIT)/config.json: | $(STAMP)
	$(BIN)/clova-train tiny-model owlvit $(TINY_OWLVIT)

demo-loc: $(STAMP) $(TINY_OWLVIT)/config.json
	$(BIN)/clova-train fit --config configs/quickstart/loc_prompt.yaml --model.init_args.on_existing_pool=overwrite
	$(BIN)/clova-train export $(LOC_RUN) --output $(LOC_RUN)/export
	$(BIN)/python -m clova_train.quickstart.demos.grounding $(LOC_RUN)/export
	$(BIN)/clova-train report $(LOC_RUN)
	$(BIN)/clova-train serve $(LOC_RUN)/export --request '{"image": "checkpoints/data/synthetic_loc/images/00001.png", "concept": "purple circle", "other_queries": ["red square", "blue triangle"]}'

# The SEG prompt tool (MaskFormer): the same on a tiny MaskFormer; the picture has the masks drawn.
$(TINY_MASKFORMER)/config.json: | $(STAMP)
	ONEDNN_MAX_CPU_ISA=SSE41 MKL_CBWR=COMPATIBLE $(BIN)/clova-train tiny-model maskformer $(TINY_MASKFORMER)  # as the tests' (conftest)

demo-seg: $(STAMP) $(TINY_MASKFORMER)/config.json
	$(BIN)/clova-train fit --config configs/quickstart/seg_prompt.yaml --model.init_args.on_existing_pool=overwrite
	$(BIN)/clova-train export $(SEG_RUN) --output $(SEG_RUN)/export
	$(BIN)/python -m clova_train.quickstart.demos.grounding $(SEG_RUN)/export
	$(BIN)/clova-train report $(SEG_RUN)
	$(BIN)/clova-train serve $(SEG_RUN)/export --request '{"image": "checkpoints/data/synthetic_seg_red_circle/images/00001.png", "concept": "purple circle"}'

# The REPLACE prompt tool (textual inversion on Stable Diffusion inpainting): fit on a tiny inpainting
# pipeline and synthetic masked shapes, export (pool + diffusers textual-inversion files), then measure the
# exported token on new images against the words, the untuned token and random tokens, repaint a green
# square with the words and with the token (pictures saved), and serve one JSON request without Lightning.
$(TINY_SD)/model_index.json: | $(STAMP)
	$(BIN)/clova-train tiny-model sd-inpaint $(TINY_SD)

demo-replace: $(STAMP) $(TINY_SD)/model_index.json
	$(BIN)/clova-train fit --config configs/quickstart/replace_prompt.yaml --model.init_args.on_existing_pool=overwrite
	$(BIN)/clova-train export $(REPLACE_RUN) --output $(REPLACE_RUN)/export
	$(BIN)/python -m clova_train.quickstart.demos.replace $(REPLACE_RUN)/export
	$(BIN)/clova-train report $(REPLACE_RUN)
	$(BIN)/clova-train serve $(REPLACE_RUN)/export --request '{"image": "checkpoints/data/synthetic_masked_concepts/orange_circle/orange_circle_000.png", "mask": "checkpoints/data/synthetic_masked_concepts/orange_circle/masks/orange_circle_000.png", "concept": "orange_circle", "output": "$(REPLACE_RUN)/export/demo/served.png", "seed": 0}'

# The tool-using LLM quickstart (LoRA on a tiny Llama, synthetic GPT4Tools data, CPU).
$(TINY_LLAMA)/config.json: | $(STAMP)
	$(BIN)/clova-train tiny-model llama $(TINY_LLAMA)

demo-llm: $(STAMP) $(TINY_LLAMA)/config.json
	$(BIN)/clova-train fit --config configs/quickstart/tool_llm_lora.yaml
	$(BIN)/clova-train export checkpoints/quickstart_llm --output checkpoints/quickstart_llm/export --merged
	$(BIN)/clova-train report checkpoints/quickstart_llm

# The HYDRA controller quickstart (DQN on the offline reasoning world, CPU, 2-3 minutes on 2 cores). Starts afresh.
demo-controller: $(STAMP)
	rm -rf checkpoints/controller_quickstart
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_dqn.yaml
	$(BIN)/clova-train controller export --config configs/quickstart/controller_dqn.yaml --output checkpoints/controller_quickstart/export
	$(BIN)/clova-train report checkpoints/controller_quickstart

# The same world with HYDRA's observation layout (one joint embedding plus the planner probabilities).
demo-controller-joint: $(STAMP)
	rm -rf checkpoints/controller_quickstart_joint
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_dqn_joint.yaml
	$(BIN)/clova-train controller export --config configs/quickstart/controller_dqn_joint.yaml --output checkpoints/controller_quickstart_joint/export
	$(BIN)/clova-train report checkpoints/controller_quickstart_joint

# AVIS: the controller picks the next tool within the transition graph (the paper's Figure 3, adapted), honouring
# its action mask; working memory and backtracking. About a minute on 2 cores. Starts afresh.
demo-avis: $(STAMP)
	rm -rf checkpoints/controller_avis
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_avis.yaml
	$(BIN)/clova-train controller export --config configs/quickstart/controller_avis.yaml --output checkpoints/controller_avis/export
	$(BIN)/clova-train report checkpoints/controller_avis

# HAMMR: a dispatcher learns which agent answers each kind of question (specialists, one of which calls another
# agent as a tool, and a generic agent with every tool). About a minute on 2 cores. Starts afresh.
demo-hammr: $(STAMP)
	rm -rf checkpoints/controller_hammr
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_hammr.yaml
	$(BIN)/clova-train controller export --config configs/quickstart/controller_hammr.yaml --output checkpoints/controller_hammr/export
	$(BIN)/clova-train report checkpoints/controller_hammr

# CLOVA's closed loop on the offline world (tiny CLIP, scripted LLM): the test stage, the training stage
# (reflection, data collection, one `clova-train fit` per blamed concept) and the test stage again; about a
# minute on 2 cores. Starts afresh.
demo-loop: $(STAMP) $(TINY_CLIP)/open_clip_config.json
	rm -rf checkpoints/quickstart_loop checkpoints/data/loop_world
	$(BIN)/clova-train loop --config configs/quickstart/loop.yaml

# The suite (under 15 minutes on 2 cores from a fresh clone, tiny-model builds included; `.ci/run` prints how long it
# took): every behaviour check, without the learning tests (marker `learning`, setup.cfg), whose claims over seeds
# the benchmarks hold (benchmarks/results/), and without the real-size smoke run (marker `real_size`: a 153M OWL-ViT
# built, fitted, exported and served on CPU by benchmarks/smoke_real.py); `make test-learning` runs those nightly.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "not learning and not real_size" --durations=15

# The nightly tier: the learning tests and the real-size smoke run. Pretrains the LOC, SEG and REPLACE models once per
# checkout (checkpoints/test-cache/), the VQA, LLM and controller models per run (its length is not measured yet).
test-learning: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "learning or real_size"

# The fast tier (a few minutes on 2 cores): without the tests marked slow (setup.cfg, tests/conftest.py), which
# use the pretrained tiny models, run DDP or killed-run subprocesses or long CLI runs, and without the learning tests.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "not slow and not learning and not real_size"

benchmark: $(STAMP)
	$(BIN)/python benchmarks/pool_retrieval.py
	$(BIN)/python benchmarks/prompt_tuning.py
	$(BIN)/python benchmarks/prompt_tuning.py --tool vqa
	$(BIN)/python benchmarks/prompt_tuning.py --tool loc
	$(BIN)/python benchmarks/prompt_tuning.py --tool seg
	$(BIN)/python benchmarks/prompt_tuning.py --tool replace
	$(BIN)/python benchmarks/lora_finetune.py
	$(BIN)/python benchmarks/controller.py
	$(BIN)/python benchmarks/prompt_pool_controls.py
	$(BIN)/python benchmarks/tool_llm_learning.py
	$(BIN)/python benchmarks/closed_loop.py
	$(BIN)/python benchmarks/cli_startup.py
	test -f $(DEMO_RUN)/export/tool.json || $(MAKE) demo
	$(BIN)/python benchmarks/serving_latency.py $(DEMO_RUN)/export --request "{\"images\": [\"$$(ls checkpoints/data/synthetic_concepts_16/*/*.png | head -1)\"], \"labels\": [\"red\", \"blue\"]}"

# Every paper config at its real model size (random weights, built offline in the real checkpoints' layouts) for a
# few steps on CPU, exported and served; prints the table and appends it to benchmarks/results/smoke_real.md. 27
# minutes on 2 cores, quiet, models built fresh (they are built once, under checkpoints/models/real-size, about 11 GB); not in `make test`.
smoke-real: $(STAMP)
	$(BIN)/python benchmarks/smoke_real.py

# On a machine with a GPU: the paper configs at real size in bf16 (Vicuna-13B at its own size), the prompt-tuning engine
# against the fair loop at the paper chunk size, serving latency of the CLIP and 13B exports, the LoRA steady state,
# within 12 minutes (benchmarks/gpu_check.py; --stages / --smoke-cases / --tools pick). Without a GPU it stops and says why.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) checkpoints/quickstart_clip checkpoints/quickstart_vqa checkpoints/quickstart_loc checkpoints/quickstart_seg checkpoints/quickstart_replace checkpoints/quickstart_llm checkpoints/controller_quickstart checkpoints/controller_quickstart_joint checkpoints/controller_avis checkpoints/controller_hammr checkpoints/quickstart_loop checkpoints/models checkpoints/data
