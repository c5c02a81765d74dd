"""`python -m jaxformer` is the `jaxformer` command."""
import sys

from jaxformer.cli import main

sys.exit(main())
