"""Argument checks shared by the public entry points: errors that name the function and the argument;
and the name the command line was started by, for its usage lines."""
import os
import sys


def command_name():
    """`ckpt-offload` when this process is the console script, else `python -m ckpt_offload`: what a
    usage line tells the reader to type is what they typed."""
    return "ckpt-offload" if os.path.basename(sys.argv[0]) == "ckpt-offload" else "python -m ckpt_offload"


def check_int(where, name, value, minimum):
    """An int (not a bool) of at least `minimum`.

    Raises:
        TypeError: `value` is not an int, or is a bool.
        ValueError: `value` is below `minimum`.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be an int >= {minimum}, got {value}")


def check_bool(where, name, value):
    """True or False, nothing that merely converts to one.

    Raises:
        TypeError: `value` is not a bool.
    """
    # A string or a number is not a switch: "no" and 0.0 would otherwise turn into True and False.
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be True or False, got {value!r} ({type(value).__name__})")


def check_not_reentrant(where, value):
    """use_reentrant=None or False is what ckpt_offload runs; True is refused with the reason.

    Raises:
        ValueError: `value` is True.
        TypeError: `value` is neither None nor a bool.
    """
    if value is None or value is False:
        return
    if value is True:
        raise ValueError(
            f"{where}: use_reentrant=True is not supported; the reentrant variant saves no inputs through "
            "saved-tensor hooks in a way offload can follow. Use use_reentrant=False (or leave it out)."
        )
    raise TypeError(f"{where}: use_reentrant must be True, False or None, got {value!r} ({type(value).__name__})")


def check_prefetch(where, prefetch, prefetch_bytes, keep_last=None):
    """The offload settings every entry point takes: prefetch >= 0, prefetch_bytes None or >= 1, and
    keep_last >= 0 where the entry point has one (None: it has none).

    Raises:
        TypeError: a setting is not an int.
        ValueError: a setting is below its minimum.
    """
    if keep_last is not None:
        check_int(where, "keep_last", keep_last, 0)
    check_int(where, "prefetch", prefetch, 0)
    if prefetch_bytes is not None:
        check_int(where, "prefetch_bytes", prefetch_bytes, 1)
