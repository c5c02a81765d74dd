"""`python -m jaxformer` is the `jaxformer` command."""

import sys

try:
  from jaxformer.cli import main
except KeyboardInterrupt:  # Ctrl-C while importing: exits as one during a command does
  print("interrupted", file=sys.stderr, flush=True)
  sys.exit(130)

sys.exit(main())
