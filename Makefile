# The everyday face of the CMake build.
#   make            build (build/)
#   make demo       build and run `kvpipe demo` (the main job)
#   make test       build and run every test, then again under ASan+UBSan and TSan
#   make asan       build build-asan/ with AddressSanitizer + UndefinedBehaviorSanitizer
#   make tsan       build build-tsan/ with ThreadSanitizer
#   make bench      the benchmark driver (bench/run.sh)
#   make install    install the library, headers, CLI, pkg-config and CMake
#                   files and docs under PREFIX (default /usr/local)
#   make deb        the Debian packages libkvpipe, libkvpipe-dev, kvpipe
#                   (build/packages/)
#   make wheel      the Python wheel for $(PYTHON) (default python3) in dist/
JOBS ?= 2
CMAKE_FLAGS ?=
PREFIX ?= /usr/local
PYTHON ?= python3

.PHONY: all build demo test test-fast asan tsan bench install deb wheel clean

all: build

build:
	cmake -S . -B build -DKVP_WERROR=ON $(CMAKE_FLAGS) >/dev/null
	cmake --build build -j$(JOBS)

demo: build
	./build/kvpipe demo

# Every test: the normal build, valgrind, then the ASan+UBSan and TSan builds.
test:
	scripts/test.sh

# Only the normal build's tests.
test-fast: build
	ctest --test-dir build --output-on-failure -j$$((2 * $(JOBS) + 1))

asan:
	cmake -S . -B build-asan -DKVP_WERROR=ON -DKVP_SANITIZE=ON $(CMAKE_FLAGS) >/dev/null
	cmake --build build-asan -j$(JOBS)

tsan:
	cmake -S . -B build-tsan -DKVP_WERROR=ON -DKVP_TSAN=ON $(CMAKE_FLAGS) >/dev/null
	cmake --build build-tsan -j$(JOBS)

bench: build
	bench/run.sh --build build

install: build
	cmake --install build --prefix "$(PREFIX)"

deb: build
	cd build && cpack -G DEB

wheel:
	$(PYTHON) -m pip wheel --no-deps --no-index --wheel-dir dist .

clean:
	rm -rf build build-asan build-tsan build-wheel dist
