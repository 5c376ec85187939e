# LLM Systems Lab. `make grade` grades student/; `make test` checks the whole kit. `make help` lists targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
IMPL ?= student
STAGE ?=
LEVEL ?= guided
# A machine with an NVIDIA driver sets up for its CUDA torch unless told otherwise (GPU= forces the CPU pins).
GPU ?= $(if $(wildcard /dev/nvidiactl),1)
WHEELS ?=
WHEEL_PYTHON ?= 3.12
WHEEL_SKIP ?=
# `make test` runs the suite's files on this many pytest processes (pytest-xdist; 0: one process, in order). Two
# halve its time on 2 cores: much of a test is waiting (for ranks, a subprocess, a grade), not computing.
TEST_JOBS ?= 2
# …where pytest-xdist is installed (an offline GPU image may lack it: then the suite runs in one process).
XDIST = $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_JOBS) --dist loadfile")
STAMP := $(VENV)/.setup-stamp$(if $(GPU),-gpu)
HAVE_REFERENCE := $(wildcard reference/__init__.py)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help setup grade test test-reference test-kit test-cluster lint student check-student release autograder check-handout soak \
        timings stages numerics mutants answers notebooks bench doctor clean wheelhouse gpu-check new-stage bench-loop lab leaderboard \
        test-clean-machine test-portable check-test figures

# `##` describes a target for `make help`; `##@instructor` marks one that needs reference/ (hidden in the student
# release), `##@student` one that only the student release has.
help: ## list the targets
	@grep -E '^[a-z-]+:.*##(@instructor|@student)? ' $(MAKEFILE_LIST) \
	    | grep -v '##@$(if $(HAVE_REFERENCE),student,instructor) ' \
	    | awk -F':.*##(@instructor|@student)? ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv, installing only what is missing (GPU=1 keeps your CUDA torch; WHEELS=dir: offline)
$(STAMP): pyproject.toml constraints-cpu.txt
	@test -x $(PY) || { command -v $(PYTHON) >/dev/null || { echo "make setup: no $(PYTHON) here: install Python 3.11" \
	    "or newer (README.md, Quick start; on macOS or Windows, the dev container)" >&2; exit 1; }; \
	    $(PYTHON) -m kit.setup.python_check && $(PYTHON) -m venv $(if $(GPU),--system-site-packages --without-pip) $(VENV); }
	$(if $(GPU),@$(PYTHON) -m kit.setup.bootstrap --link-site $(VENV))
	$(PY) -m kit.setup.bootstrap $(if $(GPU),--gpu) $(if $(WHEELS),--wheels $(WHEELS))
	@touch $@

wheelhouse: ## wheels a CUDA machine may lack into wheelhouse/ (WHEEL_PYTHON=3.12; WHEEL_SKIP="matplotlib": it has those)
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m kit.setup.bootstrap --download wheelhouse --python-version $(WHEEL_PYTHON) $(if $(WHEEL_SKIP),--skip $(WHEEL_SKIP))
	@du -sh wheelhouse; echo "copy wheelhouse/ to the GPU machine, then: make setup GPU=1 WHEELS=wheelhouse"

gpu-check: setup ##@instructor on a CUDA machine: doctor, GPU tests, compiled Stage 3, goals → benchmarks/results/gpu/ (< 8 min)
	$(PY) -m instructor gpu-check

check-kernels: setup ##@instructor compile every FlashAttention GPU config for sm_90 (D 64/128, bf16/fp16): wgmma, smem, 0 spills; no GPU
	LLMSYS_KERNEL_SWEEP=full $(PY) -m pytest tests/kit/test_kernel_candidates.py --impl reference -q -p no:cacheprovider

grade: setup ## grade student/ (IMPL=reference|PATH, STAGE=1 or 1,2) and print the score table
	$(PY) -m kit grade --impl $(IMPL) $(if $(STAGE),--stage $(STAGE)) --json grading-output/results.json

ifeq ($(HAVE_REFERENCE),)
# A student release: the tests are the graded suite on your code (`make lint` checks style separately).
test: setup grade ##@student grade student/
else
test: setup lint check-student test-reference ##@instructor everything CI checks: lint, stubs fresh, full suite on the reference
	@echo "make test: all checks passed"
endif

test-reference: setup ##@instructor the whole suite (graded, kit, notebooks) against the reference
	$(PY) -m pytest tests --impl reference $(XDIST) $(if $(STAGE),-m "$$($(PY) -m kit stages --marker-expression $(STAGE))")

test-kit: setup ##@instructor only the kit's own tests (grader, release, spawn helper)
	$(PY) -m pytest tests/kit --impl reference $(XDIST)

test-cluster: setup ##@instructor sbatch the kit's SLURM script on a 2-node SLURM started here (root; apt-get install -y slurm-wlm munge; ~1 min)
	LLMSYS_TEST_CLUSTER=1 $(PY) -m pytest tests/kit/test_cluster.py --impl reference -p no:cacheprovider -v -s

# A student's macOS run, forced on Linux (kit/setup/portable.py): fresh worker processes, psutil, no /proc, prctl or sandbox.
test-portable: setup ##@instructor the portable path forced here: the reference passes STAGE (default 1,2,4,5,6), no stub test passes
	@marks="$$($(PY) -m kit stages --marker-expression $(or $(STAGE),1,2,4,5,6))"; \
	LLMSYS_PORTABLE=1 $(PY) -m pytest tests --impl reference -q -p no:cacheprovider -m "$$marks" || exit 1; \
	out="$$(LLMSYS_PORTABLE=1 $(PY) -m pytest tests --impl student -q -p no:cacheprovider --tb=no -m "$$marks" 2>&1)"; \
	echo "stubs: $$(echo "$$out" | tail -n 1)"; \
	if echo "$$out" | tail -n 1 | grep -qE "[0-9]+ passed"; then echo "make test-portable: a stub passed" >&2; exit 1; fi

# Runs on this machine's own Python (no .venv needed); root, mmdebstrap (installed when missing), ~2 GiB in /tmp.
SUITE ?= bookworm
QUICK ?=
SOURCE ?=
test-clean-machine: ##@instructor make setup + the README's two commands in a clean Debian root (SUITE=bullseye: must stop clearly; QUICK=1 or STAGE=N: one stage; SOURCE=head: git archive HEAD)
	$(PYTHON) -m instructor clean-machine --suite $(SUITE) $(if $(QUICK),--quick) $(if $(STAGE),--stage $(STAGE)) \
	    $(if $(SOURCE),--source $(SOURCE))

lint: setup ## ruff
	$(PY) -m ruff check .

student: setup ##@instructor regenerate student/ from reference/ (LEVEL=open: public API only; never edit by hand)
	$(PY) -m instructor release --student --level $(LEVEL)

check-student: setup ##@instructor fail when student/ is stale
	$(PY) -m instructor release --check

release: setup ##@instructor build dist/student-release/ (no reference, no hidden tests; LEVEL=open as above)
	$(PY) -m instructor release --build --level $(LEVEL)

autograder: setup ##@instructor build dist/autograder.zip for Gradescope (kit + public and hidden tests, no reference)
	$(PY) -m instructor autograder

RUNS ?= 20
LOAD ?= 0
soak: setup ##@instructor run the graded reference suite RUNS times; stops at the first failure (LOAD=2: two CPU hogs alongside)
	@markers="$$($(PY) -m kit stages --marker-expression $(STAGE))" || exit 1; \
	hogs=""; for i in $$(seq $(LOAD)); do (while :; do :; done) & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT INT TERM; \
	[ $(LOAD) -gt 0 ] && echo "== $(LOAD) busy process(es) running alongside:$$hogs"; \
	for i in $$(seq $(RUNS)); do \
	    echo "== run $$i of $(RUNS) ($$(date +%T), load $$(cut -d' ' -f1 /proc/loadavg 2>/dev/null))"; \
	    $(PY) -m pytest tests --impl reference -q -p no:cacheprovider -m "$$markers" || { echo "run $$i failed"; exit 1; }; \
	done; echo "$(RUNS) consecutive green runs of the graded reference suite$(if $(filter-out 0,$(LOAD)), with $(LOAD) busy processes alongside)"

# Budgets must hold on the slowest CPU a course grades on: record on the generic code paths (no AVX-512, no bf16
# units: bf16 matmuls emulated), whatever this machine has. TIMING_PATH= records on this CPU's own paths.
TIMING_PATH ?= ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41
timings: setup ##@instructor record each graded test's reference time in tests/timings.json (the grader's per-test limits; on the slowest code paths)
	$(TIMING_PATH) $(PY) -m instructor timings $(if $(STAGE),--stage $(STAGE))

numerics: setup ##@instructor grade the reference (public + hidden) on each CPU code path a grader may take (CELL=auto: today's one; STAGE=N)
	$(PY) -m instructor numerics $(if $(CELL),--cell $(CELL)) $(if $(STAGE),--stage $(STAGE))

mutants: setup ##@instructor the misconception catalogue (tests/kit/mutants): each mistake must fail a public test (STAGE=N or auto, BUDGET=seconds, ONLY=name,name: those mistakes and the stage's designs)
	$(PY) -m instructor mutants $(if $(STAGE),--stage $(STAGE)) $(if $(BUDGET),--budget $(BUDGET)) $(if $(ONLY),--only $(ONLY))

check-test: setup ##@instructor CONTRIBUTING's checklist for a graded test file: FILE=tests/test_stage4_ddp.py (points, handout, timings, mutants)
	@test -n "$(FILE)" || { echo 'usage: make check-test FILE=tests/test_stageN_topic.py'; exit 2; }
	$(PY) -m instructor checklist $(FILE)

figures: setup ##@instructor regenerate benchmarks/results/figures.{json,md} and the figures the docs quote (<!-- fig:name --> markers)
	$(PY) -m instructor figures

new-stage: setup ##@instructor write a new stage's skeletons and registry entry (N=7 NAME=whole_step TITLE="The whole step")
	@test -n "$(N)" -a -n "$(NAME)" -a -n "$(TITLE)" || { echo 'usage: make new-stage N=7 NAME=whole_step TITLE="The whole step"'; exit 2; }
	$(PY) -m instructor new-stage $(N) $(NAME) "$(TITLE)"

answers: setup ##@instructor render the answer key (instructor/answers) into answers-output/ (STAGE=N for some stages)
	$(PY) -m instructor answers $(if $(STAGE),--stage $(STAGE))

stages: setup ## list the stages (kit/stages.py): number, title, modules, handout chapters
	@$(PY) -m kit stages

check-handout: setup ## check that the handout, the tests and the points agree
	$(PY) -m kit check-handout

notebooks: setup ## regenerate notebooks/*.ipynb from their jupytext .py twins
	$(PY) -m jupytext --to ipynb --update notebooks/[0-9]*.py

LAB_PORT ?= 8888
LAB_ARGS ?=
# The kernel is .venv's own Python (a kernelspec written into .venv, which Jupyter prefers there); the server's
# PYTHONPATH, which its kernels inherit, puts the repository root first so that `import kit` works from notebooks/.
# As root (containers), Jupyter refuses to start without allow_root.
lab: setup ## open the notebooks in JupyterLab on the kit's .venv kernel (LAB_PORT=8888; LAB_ARGS=--no-browser)
	@$(PY) -c "import jupyterlab" 2>/dev/null || { echo "make lab: JupyterLab is not installed in $(VENV)" \
	    "(optional on a GPU image): $(PY) -m pip install 'jupyterlab>=4.2', then make lab"; exit 1; }
	@$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (kit .venv)" >/dev/null
	cd notebooks && PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" "$(CURDIR)/$(PY)" -m jupyterlab \
	    --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) --ServerApp.port_retries=0 \
	    $(if $(filter 0,$(shell id -u)),--ServerApp.allow_root=True) $(LAB_ARGS)

bench: setup ## run every benchmark on IMPL (default student) into bench-output/ (SAVE=1: over the committed tables in benchmarks/results/)
	@for b in benchmarks/bench_*.py; do m=benchmarks.$$(basename $$b .py); echo "== python -m $$m"; \
	    $(PY) -m $$m --impl $(IMPL) $(if $(SAVE),--save) || exit 1; done

bench-loop: setup ##@instructor time the feedback loop (each stage's tests, the graded suite, the stubs, spawns) → benchmarks/results/loop.*
	$(PY) -m benchmarks.bench_loop --impl reference --save

leaderboard: setup ## a whole training step: correctness gate, then timing → an entry (TASK=cpu|gpu1|gpu2-8b, STEP=naive, COLLECT=dir)
	$(PY) -m kit leaderboard $(if $(COLLECT),--collect $(COLLECT),--task $(or $(TASK),cpu) --impl $(IMPL) $(if $(STEP),--step $(STEP)))

doctor: setup ## what this machine can run
	$(PY) -m kit doctor

clean: ## remove build outputs (keeps .venv)
	rm -rf dist grading-output answers-output .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
