import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Forkserver children import test modules by name: make the repository importable everywhere.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
