import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))                  # support.py
sys.path.insert(0, str(Path(__file__).parent / "integration"))  # harness.py
