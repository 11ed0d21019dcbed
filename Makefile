# kvlab: `make` builds ./run and ./export; `make test` runs every test (no GPU needed); `make model` fetches and
# exports SmolLM2-135M-Instruct; `make debug` builds with AddressSanitizer + UndefinedBehaviorSanitizer into
# build/debug, `make test-debug` runs the whole test suite on that build (any sanitizer report fails it);
# `make fuzz` runs the libFuzzer targets (tools/fuzz.sh; FUZZ_SECONDS per target).
# CUDA: when nvcc is found (PATH or /usr/local/cuda), attn.cu is compiled for sm_90 plus compute_90 PTX and linked with
# the static CUDA runtime, so ./run starts on machines without a GPU or driver (and then runs on the CPU); `make NVCC=`
# builds CPU-only. Either way tests/test_attn.cu runs the kernels' CPU twin (attn.cu compiled as C++ without nvcc).
CC      ?= cc
OPT     ?= -O3 -march=native
# -ffp-contract=off: a*b+c is fused only where the code says so (GCC's -std=c11 does not fuse; clang would)
CFLAGS  ?= $(OPT) -g -Wall -Wextra -Wno-unused-parameter -std=c11 -ffp-contract=off -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE
OMP     := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
LDLIBS  := -lm
GIT     := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
CFLAGS  += -DKVLAB_GIT='"$(GIT)"'
# the commit is compiled into eval.o (the -o records): rebuild it when HEAD moves
GIT_REFS := $(wildcard .git/HEAD .git/refs/heads/* .git/packed-refs)
BUILD   ?= build
OUT     ?= .
TESTBIN ?= tests/bin
CXX     ?= c++
CXXFLAGS = $(OPT) -g -Wall -Wextra -Wno-unused-parameter -std=c++17 -ffp-contract=off
NVCC    ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
# sm_90 code for H100/H200, and compute_90 PTX that newer GPUs compile at load time
NVFLAGS ?= -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
ifneq ($(NVCC),)
CUDA_DEF  := -DKVLAB_CUDA
CUDA_O    := $(BUILD)/attn.o
CUDA_LIBS := -L$(dir $(NVCC))../lib64 -lcudart_static -ldl -lpthread -lrt -lstdc++
CUDA_MSG  := built (sm_90 + PTX)
TWIN_O    := $(CUDA_O)
else
CUDA_MSG  := not built (no nvcc)
TWIN_O    := $(BUILD)/attn_twin.o
endif
CFLAGS  += $(CUDA_DEF)

# The engine's objects, shared by ./run and the tests; main lives in main.c (./run) and export_main.c (./export), so
# tests link everything else. tools/deps.sh prints which object uses which.
ENGINE  := util model matmul run kv kv_tier lowrank attn_cpu policies tokenizer eval task task_code task_text cli export pool trace serve
ENGINE_O := $(ENGINE:%=$(BUILD)/%.o)
LIB_O   := $(ENGINE_O) $(CUDA_O)
LDLIBS  += $(CUDA_LIBS)
TESTS   := $(patsubst tests/%.c,$(TESTBIN)/%,$(wildcard tests/test_*.c))
# each fuzz target also builds with an ordinary main (tests/fuzz/replay_main.c) that replays files through it
REPLAYS := $(patsubst tests/fuzz/fuzz_%.c,$(TESTBIN)/replay_%,$(wildcard tests/fuzz/fuzz_*.c))
HDRS    := $(wildcard *.h) $(BUILD)/cuda.flag

.PHONY: tasks stream serve-sweep all test debug test-debug fuzz model clean bench FORCE
all: $(OUT)/run $(OUT)/export tools
	@echo "kvlab: built $(OUT)/run, $(OUT)/export and the tools in $(BUILD)/ (CPU$(if $(OMP), + OpenMP,); CUDA: $(CUDA_MSG))"

$(OUT)/run: $(filter-out $(BUILD)/export.o,$(ENGINE_O)) $(BUILD)/main.o $(CUDA_O)
	$(CC) $(CFLAGS) $(OMP) -o $@ $^ $(LDLIBS)
$(OUT)/export: $(BUILD)/export.o $(BUILD)/export_main.o $(BUILD)/util.o
	$(CC) $(CFLAGS) $(OMP) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c $(HDRS) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -c -o $@ $<
$(BUILD):
	mkdir -p $@
# objects depend on whether this build has CUDA (-DKVLAB_CUDA): the flag file changes only when that does
$(BUILD)/cuda.flag: FORCE | $(BUILD)
	@echo '$(CUDA_DEF)' | cmp -s - $@ || echo '$(CUDA_DEF)' > $@
FORCE:
$(BUILD)/attn.o: attn.cu $(HDRS) | $(BUILD)
	$(NVCC) $(NVFLAGS) $(CUDA_DEF) -Xcompiler -ffp-contract=off,-Wall,-Wextra,-Wno-unused-parameter -I. -c -o $@ $<
$(BUILD)/attn_twin.o: attn.cu $(HDRS) | $(BUILD)
	$(CXX) $(CXXFLAGS) $(OMP) -x c++ -I. -c -o $@ $<

$(TESTBIN)/%: tests/%.c $(LIB_O) tests/check.h | $(TESTBIN)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
# kv_dump twice: kv.c + attn_cpu.c with this machine's vector instructions, and as portable C
# (tests/test_kv_portable.sh); test_attn_ref likewise, as attn_ref_portable (tests/test_attn_ref_portable.sh)
$(TESTBIN)/kv_dump: tests/kv_dump.c $(LIB_O) | $(TESTBIN)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
PORTABLE := -mno-avx -mno-avx2 -mno-fma -mno-f16c
KV_SRC := kv.c kv_tier.c lowrank.c attn_cpu.c policies.c pool.c util.c
$(TESTBIN)/kv_dump_portable: tests/kv_dump.c $(KV_SRC) $(HDRS) | $(TESTBIN)
	$(CC) $(CFLAGS) $(PORTABLE) $(OMP) -I. -o $@ $< $(KV_SRC) -lm
$(TESTBIN)/attn_ref_portable: tests/test_attn_ref.c tests/attn_ref_check.h $(KV_SRC) $(HDRS) | $(TESTBIN)
	$(CC) $(CFLAGS) $(PORTABLE) $(OMP) -I. -o $@ $< $(KV_SRC) -lm
$(TESTBIN)/test_attn_ref: tests/attn_ref_check.h
$(TESTBIN)/test_attn: tests/test_attn.cu $(LIB_O) $(TWIN_O) tests/check.h tests/attn_ref_check.h | $(TESTBIN)
	$(CXX) $(CXXFLAGS) $(OMP) $(CUDA_DEF) -x c++ -I. -c -o $(BUILD)/test_attn.o $<
	$(CC) $(CFLAGS) $(OMP) -o $@ $(BUILD)/test_attn.o $(sort $(LIB_O) $(TWIN_O)) $(LDLIBS) -lstdc++
$(TESTBIN)/replay_%: tests/fuzz/fuzz_%.c tests/fuzz/replay_main.c $(LIB_O) | $(TESTBIN)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< tests/fuzz/replay_main.c $(LIB_O) $(LDLIBS)
$(TESTBIN):
	mkdir -p $@

# the shell tests run $KVLAB_RUN and $KVLAB_EXPORT (./run and ./export by default)
test: all $(TESTS) $(TESTBIN)/test_attn $(TESTBIN)/kv_dump $(TESTBIN)/kv_dump_portable $(TESTBIN)/attn_ref_portable \
      $(REPLAYS)
	KVLAB_RUN=$(OUT)/run KVLAB_EXPORT=$(OUT)/export tests/run.sh $(TESTBIN)

# Sanitizer build: everything (./run, ./export, tests) in build/debug; any report (leaks included) aborts the
# process (SIGABRT, so a bad-input test that expects an ordinary error exit fails too). -march=native as the normal
# build: the vector paths that run are the ones checked (kv_dump_portable and attn_ref_portable check the portable C
# twins of the attention), and SmolLM2's forward pass runs about 4 times faster under ASan than at -O1 without it.
# KVLAB_SANITIZE=1 lets the tests skip the SmolLM2 goldens (minutes under ASan; the normal build runs them).
DEBUG_VARS := NVCC= BUILD=build/debug OUT=build/debug TESTBIN=build/debug/tests \
              OPT="-O2 -march=native -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all"
debug:
	$(MAKE) $(DEBUG_VARS) all
test-debug:
	ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1 \
	UBSAN_OPTIONS=halt_on_error=1:abort_on_error=1:print_stacktrace=1 KVLAB_SANITIZE=$${KVLAB_SANITIZE-1} \
	$(MAKE) $(DEBUG_VARS) test

FUZZ_SECONDS ?= 600
fuzz: all
	tools/fuzz.sh -t $(FUZZ_SECONDS)

# Tools (not part of ./run; `make` builds them too): build/bw, the read bandwidth; build/kl_models, KL and perplexity of two model files on one
# token stream; build/attn_bench, the CPU attention alone on SmolLM2's attention shape (kv_attend_cpu, or kv_attend_chunk with -chunk); build/batch_bench, decode throughput of S sequences in one batch. `make bench` runs tools/bench.sh (SmolLM2 decode f32/q8 against the bandwidth limit, batched ppl).
.PHONY: tools
tools: $(BUILD)/bw $(BUILD)/kl_models $(BUILD)/attn_bench $(BUILD)/batch_bench
$(BUILD)/bw: tools/bw.c $(BUILD)/util.o | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(BUILD)/util.o
$(BUILD)/kl_models: tools/kl_models.c $(LIB_O) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
$(BUILD)/attn_bench: tools/attn_bench.c $(LIB_O) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
$(BUILD)/batch_bench: tools/batch_bench.c $(LIB_O) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
bench: all tools
	tools/bench.sh

# `make report`: tools/report.sh runs the evaluation grid on SmolLM2 and the Debian Reference and writes REPORT.md with
# plots to build/report/; the committed report/ only with REPORT_OUT=report (REPORT_QUICK=1: a small grid to test it,
# in build/report-quick/; REPORT_TOKENS=N: the stream length; REPORT_DRY_RUN=1: print the plan, with the packages it
# would install, and stop).
.PHONY: report
report: all
	tools/report.sh

# the serving sweep README reports: SmolLM2, 64 requests, pool sizes 100% to 10%, full, adapt:, q8, sink, h2o
serve-sweep: all
	tools/serve_sweep.sh

# the long streams README reports: perplexity per 1,024-token bucket over the whole Debian Reference (about 212K
# tokens) for sink pos=cache and pos=orig, window, h2o, tova (tools/stream.sh: STREAM_TOKENS, STREAM_KV, ...)
stream: all
	tools/stream.sh

# the task grid and its leaderboard (score against resident KV bytes over full's): RULER's tasks at 1K and 4K tokens,
# every family at 25% and 10% of full's bytes, the shared-context protocol (tools/tasks.sh: TASKS_LIST, ...;
# TASKS_STEPS="grid ceiling ratios" adds full's ceiling at 1K, 4K, 8K and every family at four ratios at 1K)
tasks: all
	tools/tasks.sh

# always runs the script: it checks the cached GGUF's sha256 and the model.bin (a fraction of a second when both are
# good) and fetches or exports again what is missing, corrupt or stale
model: all
	./tools/fetch_model.sh

clean:
	rm -rf $(BUILD) run export tests/bin

$(BUILD)/eval.o: $(GIT_REFS)
