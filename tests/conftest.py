import os

# Triton kernels run on the CPU through the interpreter; this must be set before `import triton`.
os.environ.setdefault("TRITON_INTERPRET", "1")
