"""Where the test tree's pieces are: the repo root and this folder (shared helpers, gloo workers run as
scripts, plugin modules and fakes). tests/conftest.py puts this folder on sys.path for every test."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
