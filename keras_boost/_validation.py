"""Argument checks shared by every constructor: one message style for all of keras_boost.

Every check raises `TypeError` when the value has the wrong kind and `ValueError` when it
has the right kind but lies outside what is allowed, with one message form:

    `name` must be <what is allowed>, got <value> (<type>).

The checks are pure Python (NumPy scalars accepted), so `keras_boost.config` can use them
without importing TensorFlow.
"""

import math
import numbers


def _got(value):
    return f"got {value!r} ({type(value).__name__})"


def _int_kind(minimum, maximum):
    if maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive int"
    if minimum == 0:
        return "a non-negative int"
    return "an int" if minimum is None else f"an int >= {minimum}"


def check_int(name, value, minimum=None, maximum=None, allowed=None):
    """`value` as an int; bools are refused. `allowed` overrides the description."""
    allowed = allowed or _int_kind(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be {allowed}, {_got(value)}.")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"`{name}` must be {allowed}, {_got(value)}.")
    return int(value)


def check_optional_int(name, value, minimum=None, maximum=None):
    if value is None:
        return None
    return check_int(name, value, minimum, maximum, allowed=f"None or {_int_kind(minimum, maximum)}")


def check_real(name, value, low=None, low_inclusive=True, high=None, high_inclusive=True, allowed=None):
    """`value` as a finite float within the bounds; bools are refused."""
    if allowed is None:
        parts = []
        if low is not None:
            parts.append(f"{'>=' if low_inclusive else '>'} {low}")
        if high is not None:
            parts.append(f"{'<=' if high_inclusive else '<'} {high}")
        allowed = "a finite number" + (" " + " and ".join(parts) if parts else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be {allowed}, {_got(value)}.")
    out_of_range = not math.isfinite(value)
    if low is not None:
        out_of_range |= value < low or (value == low and not low_inclusive)
    if high is not None:
        out_of_range |= value > high or (value == high and not high_inclusive)
    if out_of_range:
        raise ValueError(f"`{name}` must be {allowed}, {_got(value)}.")
    return float(value)


def check_bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool (True or False), {_got(value)}.")
    return value


def check_choice(name, value, choices):
    """`value` when it is one of `choices` (compared with ==, bools never match ints)."""
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    raise ValueError(f"`{name}` must be one of {list(choices)}, {_got(value)}.")


def check_split_points(points, name="gradient_split_groups"):
    """None or strictly increasing positive ints (indices where a new fused allreduce starts), or "each"."""
    if points is None:
        return []
    if isinstance(points, str) and points == "each":
        return "each"
    allowed = "None, \"each\" or a strictly increasing list of positive ints"
    if not isinstance(points, (list, tuple)) or not all(
            isinstance(p, numbers.Integral) and not isinstance(p, bool) and p > 0 for p in points):
        raise ValueError(f"`{name}` must be {allowed}, {_got(points)}.")
    if list(points) != sorted(set(points)):
        raise ValueError(f"`{name}` must be {allowed}, {_got(points)}.")
    return [int(p) for p in points]


def alias(name, value, alias_name, alias_value, default=None):
    """The value of an argument that MindSpore spells `alias_name`: given once, under either name."""
    if alias_value is default:
        return value
    if value is not default:
        raise TypeError(f"`{name}` and `{alias_name}` are the same argument (`{alias_name}` is MindSpore's "
                        f"name); give one of them, got both: {value!r} and {alias_value!r}.")
    return alias_value


def check_steps(name, value, minimum=1):
    """A positive step count: an int, or a float with an integral value (MindSpore's `2000.0`)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, numbers.Integral)) and (
            math.isfinite(value) and float(value).is_integer()):
        value = int(value)
    return check_int(name, value, minimum, allowed="a positive int (or a float with an integral value)")


def check_sens(sens):
    if isinstance(sens, bool) or not isinstance(sens, numbers.Real):
        raise TypeError(f"`sens` must be a finite non-zero number (the scale of the loss gradient), got {sens!r} "
                        f"({type(sens).__name__}).")
    if sens == 0 or not math.isfinite(sens):
        raise ValueError(f"`sens` must be a finite non-zero number (the scale of the loss gradient), got {sens!r} "
                         f"({type(sens).__name__}).")
    return float(sens)


def positive_int_arg(text):
    """argparse type: a positive integer (`keras-boost` flags)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
