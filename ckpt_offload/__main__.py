"""`python -m ckpt_offload <command>` (also installed as `ckpt-offload`): `env`, the report to paste
into a bug report, and `estimate`, the memory of a training step sized without a GPU.

Each command is a module with `main(argv) -> int`, imported only when it runs, so that `env` works
even where importing the compiled core fails (it is then part of the report).
"""
import importlib
import sys

from ._args import command_name

COMMANDS = {
    "env": ("ckpt_offload.envreport", "what this machine, its torch and this build are (for bug reports)"),
    "estimate": ("ckpt_offload.sizing.cli", "the memory of a training step, sized on the meta device"),
}


def usage() -> str:
    name = command_name()
    lines = [f"usage: {name} <command> [options]", "", "commands:"]
    lines += [f"  {name:<10}{doc}" for name, (_, doc) in COMMANDS.items()]
    lines.append(f"\n`{name} <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ckpt_offload: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise  # the command exists and a module it imports is missing: that error is the one to see
        print(f"ckpt_offload: the {name!r} command is not part of this installation ({module_name} is "
              f"missing); ckpt_offload {_version()}", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


def _version():
    from ._version import __version__

    return __version__


if __name__ == "__main__":
    sys.exit(main())
