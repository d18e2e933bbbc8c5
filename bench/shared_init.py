"""The starting weights bench-e2e computes (llm/src/shared_init.rs), in torch: each element a
32-bit hash of (seed, parameter position in module order, flat index in burn's layout), so every
system in a benchmark trains the same model from step 0. Vectors are ones; matrices uniform in
+-0.02*sqrt(3). burn's Linear holds its weight as [in, out], torch's as [out, in]: the values are
made in burn's layout and transposed. `python3 bench/shared_init.py` prints the hashes
llm/src/shared_init.rs's test expects."""
import torch

MATRIX_BOUND = 0.03464101615137754
M = 0xFFFFFFFF
CHUNK = 1 << 26


def shared_hash(seed, position, index):
    """index: an int64 tensor; the same bits as shared_init::shared_hash."""
    x = (index * 0x9E3779B1 + (position * 0x85EBCA77 + seed)) & M
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M
    return x ^ (x >> 16)


def values(seed, position, shape, device):
    """The parameter at `position`, in burn's shape `shape`, float32."""
    n = 1
    for d in shape:
        n *= d
    if len(shape) < 2:
        return torch.ones(shape, dtype=torch.float32, device=device)
    out = torch.empty(n, dtype=torch.float32, device=device)
    bound = torch.tensor(MATRIX_BOUND, dtype=torch.float32).item()
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        h = shared_hash(seed, position, torch.arange(start, end, dtype=torch.int64, device=device))
        u = (h >> 8).to(torch.float32)
        out[start:end] = (u * (2.0 / 16777216.0) - 1.0) * bound
    return out.view(shape)


def torch_values(seed, position, module, shape, device):
    """The parameter at `position` of `module` in torch's layout `shape`: nn.Linear weights
    are made as burn's [in, out] and transposed."""
    if isinstance(module, torch.nn.Linear):
        return values(seed, position, (shape[1], shape[0]), device).t()
    return values(seed, position, tuple(shape), device)


def parameters_in_order(model):
    """(name, owning module, parameter) in registration order."""
    out = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            out.append((f"{mname}.{pname}" if mname else pname, module, p))
    return out


if __name__ == "__main__":
    cases = [(0, 0), (1, 2), (7, 123456789), (290, 525336575)]
    print([int(shared_hash(42, p, torch.tensor(i, dtype=torch.int64))) for p, i in cases])
    print([float(values(42, 3, (4, 5), "cpu").flatten()[i]) for i in (0, 7, 19)])
