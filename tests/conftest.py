import sys
from pathlib import Path

# Allow running the tests from a checkout without `pip install -e .`.
ROOT = Path(__file__).resolve().parents[1]
for sub in ("operator", "runtime", "kernels", "tests"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)
