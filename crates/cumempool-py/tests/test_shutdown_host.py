"""The plug-ins' C functions during interpreter shutdown, on a stand-in libcuda (no GPU): an
out-of-memory callback reached from a thread that must attach to Python is not called once the
interpreter is shutting down (the allocation answers out of memory), so no thread attaches to a
finalizing interpreter."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_fake_driver import FAKE_LIBCUDA, PRELUDE, TORCH_FUNCTIONS

# The stand-in's allocation, made slow and out of memory for huge sizes: a thread stays inside
# the driver while the interpreter begins finalizing, then meets the out-of-memory callback.
SLOW_OUT_OF_MEMORY = """
#include <pthread.h>
#include <unistd.h>
static CUresult slow_alloc_from_pool(uint64_t *p, size_t n, void *pool, CUstream s) {
    if (n >= ((size_t)1 << 40)) { usleep(500 * 1000); return 2; }
    return alloc_from_pool(p, n, pool, s);
}
/* A thread Python does not know, as PyTorch's are, calling the plug-in's allocation. */
typedef void *(*torch_alloc)(long, int, void *);
static volatile int alloc_returned;
static void *alloc_huge(void *fn) { ((torch_alloc)fn)((long)1 << 40, 0, 0); alloc_returned = 1; return 0; }
int start_alloc_thread(void *fn) { pthread_t t; return pthread_create(&t, 0, alloc_huge, fn) || pthread_detach(t); }
int alloc_thread_returned(void) { return alloc_returned; }
"""


@pytest.fixture(scope="module")
def slow_libcuda(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the stand-in driver")
    entry, table = '{"cuMemAllocFromPoolAsync", alloc_from_pool}', "static const struct"
    assert FAKE_LIBCUDA.count(entry) == 1 and FAKE_LIBCUDA.count(table) == 1
    source_text = FAKE_LIBCUDA.replace(entry, '{"cuMemAllocFromPoolAsync", slow_alloc_from_pool}')
    source_text = source_text.replace(table, SLOW_OUT_OF_MEMORY + table)
    directory = tmp_path_factory.mktemp("slow_libcuda")
    source = directory / "slow.c"
    source.write_text(source_text)
    library = directory / "libslowcuda.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-pthread", "-o", str(library), str(source)], check=True)
    return str(library)


def test_an_out_of_memory_callback_is_not_called_into_a_finalizing_interpreter(slow_libcuda):
    code = PRELUDE + TORCH_FUNCTIONS + textwrap.dedent(
        """
        import sys, time
        # A callback without this module's globals: what is served is kept to the end of the
        # process, and with it whatever the callback's globals hold (the object below).
        on_oom = eval("lambda requested, attempt: False", {})
        cmt.serve(cm.OnOutOfMemory(cm.PoolResource(pool), on_oom))
        print(lib.cumempool_torch_alloc(1 << 40, 0, None), flush=True)  # control: answered, None
        class LingeringExit:
            # Collected while the interpreter finalizes (holding what it uses: modules may be
            # torn down by then). Sleeping releases the GIL, so the thread below meets the
            # callback while the interpreter is finalizing; then it reports whether the
            # thread's call came back.
            def __init__(self):
                self.sleep, self.out, self.returned = time.sleep, sys.stdout, cuda.alloc_thread_returned
            def __del__(self):
                self.sleep(1.5)
                self.out.write(f"returned={self.returned()}\\n")
                self.out.flush()
        lingering = LingeringExit()
        cuda.start_alloc_thread(ctypes.cast(lib.cumempool_torch_alloc, ctypes.c_void_p))
        time.sleep(0.1)  # the thread is in the driver now, for 0.5 s
        print("exiting", flush=True)
        """
    )
    env = dict(os.environ, CUMEMPOOL_LIBCUDA=slow_libcuda)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, f"the process died at exit ({out.returncode}): {out.stderr}"
    assert out.stdout.split()[:2] == ["None", "exiting"], out.stderr
    assert out.stdout.split()[2:] == ["returned=1"], "the thread attached to the finalizing interpreter (and was ended)"
