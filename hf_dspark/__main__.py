"""`python -m hf_dspark ...` is the `hf-dspark` command (useful where the console script is not on PATH yet)."""

import sys

from hf_dspark.cli.main import main

sys.exit(main())
