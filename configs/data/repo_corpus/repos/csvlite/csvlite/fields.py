"""One CSV line at a time."""


def parse_line(line):
    """Fields of one line; quoted fields may hold commas and doubled quotes."""
    fields, current, quoted, i = [], [], False, 0
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ",":
            fields.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    fields.append("".join(current))
    return fields


def to_line(fields):
    def quote(field):
        if any(c in field for c in ',"'):
            return '"' + field.replace('"', '""') + '"'
        return field

    return ",".join(quote(f) for f in fields)
