"""The calendarx package."""
