# kvlab: `make` builds ./run and ./export; `make test` runs every test (no GPU needed); `make model` fetches and
# exports SmolLM2-135M-Instruct; `make debug` builds with AddressSanitizer + UndefinedBehaviorSanitizer.
CC      ?= cc
OPT     ?= -O3 -march=native
CFLAGS  ?= $(OPT) -g -Wall -Wextra -Wno-unused-parameter -std=c11 -D_POSIX_C_SOURCE=200809L -D_DEFAULT_SOURCE
OMP     := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
LDLIBS  := -lm
GIT     := $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
CFLAGS  += -DKVLAB_GIT='"$(GIT)"'
BUILD   ?= build

# The engine's objects, shared by ./run, ./export and the tests. run.c and export.c are also compiled with
# KVLAB_NO_MAIN so tests can call their loaders and parsers.
ENGINE  := kv policies tokenizer eval
ENGINE_O := $(ENGINE:%=$(BUILD)/%.o)
LIB_O   := $(ENGINE_O) $(BUILD)/run_lib.o $(BUILD)/export_lib.o
TESTS   := $(patsubst tests/%.c,tests/bin/%,$(wildcard tests/test_*.c))
HDRS    := $(wildcard *.h)

.PHONY: all test debug model clean bench
all: run export
	@echo "kvlab: built ./run and ./export (CPU$(if $(OMP), + OpenMP,); CUDA: not built)"

run: $(ENGINE_O) $(BUILD)/run.o
	$(CC) $(CFLAGS) $(OMP) -o $@ $^ $(LDLIBS)
export: $(BUILD)/export.o
	$(CC) $(CFLAGS) $(OMP) -o $@ $^ $(LDLIBS)

$(BUILD)/%.o: %.c $(HDRS) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -c -o $@ $<
$(BUILD)/%_lib.o: %.c $(HDRS) | $(BUILD)
	$(CC) $(CFLAGS) $(OMP) -DKVLAB_NO_MAIN -c -o $@ $<
$(BUILD):
	mkdir -p $@

tests/bin/%: tests/%.c $(LIB_O) tests/check.h | tests/bin
	$(CC) $(CFLAGS) $(OMP) -I. -o $@ $< $(LIB_O) $(LDLIBS)
tests/bin:
	mkdir -p $@

test: all $(TESTS)
	tests/run.sh tests/bin

debug:
	$(MAKE) BUILD=build/debug OPT="-O1 -fno-omit-frame-pointer -fsanitize=address,undefined" run export

model: all models/smollm2-135m-instruct.bin
models/smollm2-135m-instruct.bin: | export
	./tools/fetch_model.sh

clean:
	rm -rf $(BUILD) run export tests/bin
