import sys

from opd_jax.cli import main

sys.exit(main())
