"""Calendar helpers."""

DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap_year(year):
    return year % 4 == 0


def days_in_month(year, month):
    if month == 2 and is_leap_year(year):
        return 29
    return DAYS[month - 1]
