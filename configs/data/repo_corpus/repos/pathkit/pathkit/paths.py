"""POSIX path helpers."""


def normalize(path):
    """Collapse '.', '..' and repeated slashes; '..' past the start of a relative path is kept."""
    absolute = path.startswith("/")
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            continue
        parts.append(part)
    joined = "/".join(parts)
    return "/" + joined if absolute else (joined or ".")


def join(*parts):
    return normalize("/".join(parts))
