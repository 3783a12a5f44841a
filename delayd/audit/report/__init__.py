"""The report of a run: what it found (``result``), as a console table and a
self-contained HTML page with its chart."""
