"""The `jaxformer` command: `train | eval | average` (cli/train.py), `translate | generate | serve`
(cli/inference.py), `config | bench | compile` (cli/tools.py), `plot | attention` (cli/plots.py) and
`export | import` (cli/interop.py); the shared flags and argument types are in cli/args.py. Each group's
handlers import the library when they run, so `jaxformer --help` loads no JAX.

User mistakes (bad config, mesh, paths, missing checkpoints) print one `error:` line and
exit with status 2; results are JSON lines on stdout (the last line of `eval` is one
JSON object).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxformer.cli import inference, interop, plots, tools, train
from jaxformer.cli.args import CONFIG_HINT, parse_command_line
from jaxformer.config import ConfigError
from jaxformer.errors import CheckpointError, NonFiniteError

GROUPS = (train, inference, tools, plots, interop)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="jaxformer", description="Train and use Transformer models in JAX.", epilog=CONFIG_HINT
  )
  sub = p.add_subparsers(dest="command", required=True)
  for group in GROUPS:
    group.add_parsers(sub)
  return p


def main(argv: list[str] | None = None) -> int:
  """Runs the `jaxformer` command line `argv` (default: `sys.argv[1:]`).

  Returns:
    The exit status: 0, or 2 after printing a user mistake as one `error:` line on stderr.
  """
  commands = {name: command for group in GROUPS for name, command in group.COMMANDS.items()}
  try:
    args = parse_command_line(_parser(), argv)  # inside: a Ctrl-C while parsing exits 130 like one during the command
    commands[args.command](args)
  except (ConfigError, CheckpointError, NonFiniteError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    from jaxformer.runtime.interrupt import exit_interrupted

    exit_interrupted()  # status 130 (SIGINT) or 143 (SIGTERM), without a teardown that native threads could race
  except BrokenPipeError:  # stdout closed early (`| head`): stop quietly
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
