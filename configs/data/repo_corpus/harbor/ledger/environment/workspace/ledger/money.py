"""Money amounts in cents."""


def format_cents(cents):
    """'$1,234.05'; negative amounts as '-$1.00'."""
    dollars, rest = divmod(abs(cents), 100)
    if cents < 0:
        dollars = -dollars
    return f"${dollars:,}.{rest:02d}"


def parse_money(text):
    text = text.replace("$", "").replace(",", "")
    negative = text.startswith("-")
    dollars, _, rest = text.lstrip("-").partition(".")
    cents = int(dollars) * 100 + int((rest + "00")[:2])
    return -cents if negative else cents
