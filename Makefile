# Set-up and entry points. `make demo` and `make test` work from a fresh clone: they create .venv,
# install torch (pinned to the wheels this project is tested with), the package and its dev extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_RUN := checkpoints/quickstart_clip
TINY_CLIP := checkpoints/models/tiny-clip
TINY_LLAMA := checkpoints/models/tiny-llama

# The demos run ATen on its portable kernels, so that they print the documentation's figures on any x86 host: the tiny
# models are pretrained for minutes, and AVX2 or AVX-512 rounding builds other (equally good, not identical)
# models. The tests and benchmarks run on the host's own kernels (the learning tests assert effects over seeds
# that hold on either; tests/tools/test_*_learning.py).
demo demo-%: export ATEN_CPU_CAPABILITY = default
# oneDNN below AMX: on an AMX host its bf16 attention asks ATen's portable kernels for VNNI packing and fails
demo demo-%: export ONEDNN_MAX_CPU_ISA ?= AVX512_CORE_FP16

.PHONY: demo demo-llm demo-controller demo-controller-joint demo-avis demo-hammr demo-hydra-benchmark demo-avis-benchmark demo-hammr-benchmark demo-loop test test-learning test-fast install benchmark smoke-real gpu-check clean

install: $(STAMP)

$(STAMP): setup.cfg setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(TINY_CLIP)/open_clip_config.json: | $(STAMP)
	$(BIN)/clova-train tiny-model clip $(TINY_CLIP)

# A prompt tool's demo, from its recipe (clova_train/tools/<name>/recipe.py; clova_train/quickstart/demo.py runs it):
# build its tiny model once, fit its quickstart config on synthetic data, export, run its demo module on the export
# (what the prompts changed on held-out data, without Lightning), report the run and serve one JSON request.
# `make demo` is CLIP's; `make demo-vqa`, `demo-loc`, `demo-seg`, `demo-replace` and any tool with a recipe the same way.
demo: demo-clip

demo-%: $(STAMP)
	$(BIN)/python -m clova_train.quickstart.demo $*

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

# HYDRA on a benchmark's own files, offline: a GQA-format training set and an OK-VQA-format evaluation set rendered
# from the shapes world, tiny OWL-ViT / CLIP / BLIP tools (pretrained once, exported unprompted) and a tiny depth
# model (clova_train/quickstart/hydra_benchmark.py); trains on the one and evaluates on the other. Starts afresh.
demo-hydra-benchmark: $(STAMP)
	$(BIN)/python -m clova_train.quickstart.hydra_benchmark
	rm -rf checkpoints/controller_hydra_benchmark
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_hydra_benchmark.yaml
	$(BIN)/clova-train report checkpoints/controller_hydra_benchmark

# AVIS and HAMMR on the same files and tools (make demo-hydra-benchmark's preparation, reused when there): the tools
# run on each task's image, answers scored by VQA accuracy. Start afresh.
demo-avis-benchmark demo-hammr-benchmark: demo-%-benchmark: $(STAMP)
	$(BIN)/python -m clova_train.quickstart.hydra_benchmark
	rm -rf checkpoints/controller_$*_benchmark
	$(BIN)/clova-train controller fit --config configs/quickstart/controller_$*_benchmark.yaml
	$(BIN)/clova-train report checkpoints/controller_$*_benchmark

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
	for tool in $$($(BIN)/python -m clova_train.quickstart.demo --list); do $(BIN)/python benchmarks/prompt_tuning.py --tool $$tool || exit 1; done
	$(BIN)/python benchmarks/lora_finetune.py
	$(BIN)/python benchmarks/controller.py
	$(BIN)/python benchmarks/controller_tool_throughput.py
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
	rm -rf $(VENV) checkpoints/quickstart_* checkpoints/controller_quickstart checkpoints/controller_quickstart_joint checkpoints/controller_avis checkpoints/controller_hammr checkpoints/controller_hydra_benchmark checkpoints/controller_avis_benchmark checkpoints/controller_hammr_benchmark checkpoints/quickstart_loop checkpoints/models checkpoints/data
