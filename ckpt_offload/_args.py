"""Argument checks shared by the public entry points: errors that name the function and the argument;
and the name the command line was started by, for its usage lines."""
import difflib
import inspect
import os
import re
import sys
import warnings

# The keywords torch.utils.checkpoint.checkpoint consumes itself (use_reentrant aside, which every
# entry point takes by name): what an entry point that forwards keywords to it accepts.
CHECKPOINT_KEYS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop",
                   "respect_saved_tensors_hooks")


def check_keywords(where, given, known, own=(), note=""):
    """Every name in `given` (a dict of keywords, or names) is one of `known`.

    `own`: the entry point's named parameters (or the entry point itself, whose signature names
    them), offered with `known` as the close match, so that a misspelt `offlaod=` names `offload`
    instead of travelling on to a function that ignores it.
    `note`: said after the rest of the message.

    Raises:
        TypeError: a name is not in `known`; the message names the closest known or own name.
    """
    known = tuple(known)
    if callable(own):
        own = [p.name for p in inspect.signature(own).parameters.values()
               if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for name in given:
        if name in known:
            continue
        candidates = [n for n in (*own, *known) if n != name]
        close = difflib.get_close_matches(name, candidates, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        accepted = f" It accepts {', '.join(known)} besides its named parameters." if known else ""
        raise TypeError(f"{where}: unexpected keyword {name!r}{hint}{accepted}{note}")


# The libraries between a user's line and a warning said deep in a step: a warning names the first
# frame outside them (the user's call), not torch's checkpoint.py or a Trainer's loop.
_LIBRARIES = ("ckpt_offload", "torch", "transformers", "accelerate", "peft", "trl", "deepspeed", "diffusers")


def _library_dirs():
    dirs = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn_at_caller(message, category=UserWarning):
    """warnings.warn(message, category) attributed to the first frame outside ckpt_offload, torch and
    the training libraries that call into it: the user's own line (the outermost frame when every
    frame is theirs)."""
    dirs = _library_dirs()
    frame = sys._getframe(1)
    level = 2  # 1 would be this function, 2 its caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


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


# Size units, as the estimate command and host_pool().set_capacity read them: K/M/G/T and KiB..TiB
# binary, KB..TB decimal.
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_size(text: str) -> int:
    """Bytes from "80GiB", "80G" (binary), "80GB" (decimal), "1.5TiB" or a plain number of bytes.

    Raises:
        ValueError: not a number with a known unit, or not above 0.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"bad size {text!r}: expected a number with an optional unit, such as 80GiB, 80G, 80GB, 2TiB or 1073741824")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def check_size(where, name, value, minimum=0):
    """A number of bytes: an int (not a bool) of at least `minimum`, or a string parse_size reads.

    Raises:
        TypeError: neither an int nor a string (a bool, a float, None).
        ValueError: an int below `minimum`; a string that is not a size (the message says why).
    """
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be a number of bytes (an int) or a size such as '4GiB', "
                        f"got {value!r} ({type(value).__name__})")
    check_int(where, name, value, minimum)
    return value
