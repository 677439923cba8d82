"""Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1: on CPU tensors, without a
GPU). The launchers take options that suit the interpreter there (wider blocks, float32 dots), and
specdec's dispatch lets CPU tensors reach the Triton backend. Imports nothing, not even triton,
so that asking never fails where triton is missing."""
import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = ["interpreting"]
