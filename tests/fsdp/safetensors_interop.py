"""safetensors_interop.py DIR: the Python half of Safetensors.InteroperatesWithPythonSafetensors.

Reads DIR/cpp.safetensors (written by tdist: the recipe below) with safetensors.torch.load_file
and checks every tensor, dtype, shape and the metadata; reads DIR/cpp_model.safetensors (a
module tdist saved) and writes its tensors doubled to DIR/py_model.safetensors; writes the
recipe to DIR/py.safetensors. Exit 0 when everything matched, 1 otherwise.
"""

import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def recipe():
    def ar(n):
        return torch.arange(n, dtype=torch.float64)
    return {
        "f32": (ar(6) * 0.5 - 1).to(torch.float32).view(2, 3),
        "f64": (ar(4) * 0.5 - 1).view(4),
        "f16": (ar(6) * 0.5 - 1).to(torch.float16).view(3, 2),
        "bf16": (ar(5) * 0.5 - 1).to(torch.bfloat16),
        "i64": (ar(4) - 2).to(torch.int64).view(2, 2),
        "i32": (ar(3) - 2).to(torch.int32),
        "i16": (ar(2) - 2).to(torch.int16),
        "i8": (ar(4) - 2).to(torch.int8),
        "u8": ar(6).to(torch.uint8),
        "bool": ar(5).to(torch.int64) % 2 == 1,
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3),
    }


def main():
    d = sys.argv[1]
    ok = True
    got = load_file(f"{d}/cpp.safetensors")
    want = recipe()
    if sorted(got) != sorted(want):
        print(f"names differ: {sorted(got)} vs {sorted(want)}")
        ok = False
    for name, t in want.items():
        g = got.get(name)
        if g is None or g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            print(f"{name}: got {g!r}, want {t!r}")
            ok = False
    with safe_open(f"{d}/cpp.safetensors", framework="pt") as f:
        if f.metadata() != {"written_by": "tdist"}:
            print(f"metadata: {f.metadata()}")
            ok = False
    if ok:
        print("C++ file equals the recipe")
    model = load_file(f"{d}/cpp_model.safetensors")
    save_file({k: v * 2 for k, v in model.items()}, f"{d}/py_model.safetensors")
    save_file(recipe(), f"{d}/py.safetensors")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
