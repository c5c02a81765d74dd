"""`python -m jaxformer` is the `jaxformer` command."""
import sys

try:
  from jaxformer.cli import main
except KeyboardInterrupt:   # Ctrl-C while importing: the status of one during a command (128 + SIGINT)
  sys.exit(130)

sys.exit(main())
