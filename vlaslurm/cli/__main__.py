"""`python -m vlaslurm.cli ...` is `vlaslurm ...`."""

import sys

from vlaslurm.cli import main

sys.exit(main())
