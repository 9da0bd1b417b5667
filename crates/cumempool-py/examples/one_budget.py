"""One budget for the whole process: PyTorch (its cudaMallocAsync backend), CuPy
(MemoryAsyncPool("current")) and cuda.core (DeviceMemoryResource(0)) all draw from one 1 GiB pool
made current for device 0, with no plug-in. Each library takes a share, the pool's counters show
how much each took, then each in turn fills the budget and gets its OWN out-of-memory error (the
one its users already catch), while the others keep running: once it frees, they allocate again.

    python3 crates/cumempool-py/examples/one_budget.py     (needs a GPU, torch, cupy and cuda.core)

PyTorch picks its allocator when it is imported: this script sets
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync first, unless the variable is already set (then it
must ask for that backend).
"""

import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")

import cupy  # noqa: E402 (after the variable PyTorch reads)
import torch  # noqa: E402

try:
    from cuda.core import Device, DeviceMemoryResource
except ImportError:  # cuda.core before 0.4
    from cuda.core.experimental import Device, DeviceMemoryResource

import cumempool as cm  # noqa: E402

MIB = 1 << 20
BUDGET = 1 << 30
CHUNK = 64 * MIB
SHARES = {"PyTorch": 6, "CuPy": 4, "cuda.core": 2}  # chunks each library keeps: 384, 256, 128 MiB

if torch.cuda.memory.get_allocator_backend() != "cudaMallocAsync":
    sys.exit("PyTorch runs another allocator: start this script with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync")

route = cm.Route.device(0)
pool = cm.MemPool(route, max_size=BUDGET)
guard = cm.set_current_pool(route, pool)  # before the libraries look up the current pool


def settle():
    """Waits for every stream of the device, so frees are done and counters final."""
    torch.cuda.synchronize()


class Torch:
    name = "PyTorch"

    def alloc(self):
        return torch.empty(CHUNK, dtype=torch.uint8, device="cuda")

    def free(self, chunks):
        chunks.clear()

    def is_own_out_of_memory(self, error):
        return isinstance(error, torch.OutOfMemoryError)


class CuPy:
    name = "CuPy"

    def __init__(self):
        self.allocator = cupy.cuda.MemoryAsyncPool("current")

    def alloc(self):
        with cupy.cuda.using_allocator(self.allocator.malloc):
            return cupy.empty(CHUNK, dtype=cupy.uint8)

    def free(self, chunks):
        chunks.clear()

    def is_own_out_of_memory(self, error):
        return isinstance(error, cupy.cuda.memory.OutOfMemoryError)


class CudaCore:
    name = "cuda.core"

    def __init__(self):
        device = Device(0)
        device.set_current()
        self.stream = device.create_stream()
        self.resource = DeviceMemoryResource(0)  # the device's current pool: ours

    def alloc(self):
        return self.resource.allocate(CHUNK, stream=self.stream)

    def free(self, chunks):
        for buffer in chunks:
            buffer.close(self.stream)
        chunks.clear()

    def is_own_out_of_memory(self, error):
        # cuda.core raises its CUDAError, naming the driver's code.
        return type(error).__name__ == "CUDAError" and "CUDA_ERROR_OUT_OF_MEMORY" in str(error)


def error_name(error):
    kind = type(error)
    return f"{kind.__module__}.{kind.__qualname__}"


def fill(library):
    """Allocates chunks until the library raises; its chunks and its error, which must be the
    library's own out-of-memory error."""
    chunks = []
    try:
        while True:
            chunks.append(library.alloc())
            if len(chunks) > BUDGET // CHUNK:
                raise AssertionError(f"{library.name} allocated past the {BUDGET // MIB} MiB budget")
    except Exception as error:  # noqa: BLE001 (checked: only the library's own error is expected)
        if not library.is_own_out_of_memory(error):
            raise
        return chunks, error


libraries = [Torch(), CuPy(), CudaCore()]

# Each library takes its share; the pool's counters say how much each took.
kept, share = {}, {}
for library in libraries:
    settle()
    before = pool.used_mem_current
    kept[library.name] = [library.alloc() for _ in range(SHARES[library.name])]
    settle()
    share[library.name] = pool.used_mem_current - before
    assert share[library.name] == SHARES[library.name] * CHUNK, (library.name, share[library.name])

# Each in turn fills the budget and gets its own error; at the cap the others get theirs too; once
# it has freed, the next one allocates.
free_at_start = BUDGET - sum(share.values())
filled = {}
for library in libraries:
    chunks, error = fill(library)
    settle()
    at_cap = pool.used_mem_current
    assert len(chunks) * CHUNK == free_at_start and at_cap == BUDGET, (library.name, len(chunks), at_cap)
    for other in libraries:
        if other is not library:
            more, _ = fill(other)  # its own error at once: the budget is spent
            assert not more, (other.name, len(more))
    filled[library.name] = (len(chunks) * CHUNK, at_cap, error_name(error))
    library.free(chunks)
    settle()
    assert pool.used_mem_current == BUDGET - free_at_start

# Every library still works: each allocates again and lets go.
for library in libraries:
    again = [library.alloc()]
    library.free(again)
settle()

print(f"one budget of {BUDGET // MIB} MiB: a pool made current for device 0, drawn on by three libraries")
print(f"  {'library':<11}{'share':>9}  {'filled the rest':>16}  {'used at the cap':>16}  its own out-of-memory error")
for library in libraries:
    extra, at_cap, name = filled[library.name]
    print(
        f"  {library.name:<11}{share[library.name] // MIB:>5} MiB  {'+' + str(extra // MIB) + ' MiB':>16}  {str(at_cap // MIB) + ' MiB':>16}  {name}"
    )
print(
    f"  pool: used {pool.used_mem_current // MIB} MiB now, {pool.used_mem_high // MIB} MiB at most, "
    f"reserved {pool.reserved_mem_high // MIB} MiB at most, of {BUDGET // MIB} MiB"
)
print("at the cap every library raised its own error; after each had freed, the others allocated again")

# Let go: the shares, then the route.
for library in libraries:
    library.free(kept[library.name])
settle()
assert pool.used_mem_current == 0, pool.used_mem_current
guard.restore()
print("done")
