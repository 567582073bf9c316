"""Looking values up in nested data with dotted paths."""


def get_path(data, path, default=None):
    """data["a"]["b"][0] for "a.b.0"; default when any step is missing."""
    current = data
    for key in path.split("."):
        if isinstance(current, dict) and key in current:
            current = current[key]
        else:
            return default
    return current


def set_path(data, path, value):
    *parents, last = path.split(".")
    current = data
    for key in parents:
        current = current.setdefault(key, {})
    current[last] = value
    return data
