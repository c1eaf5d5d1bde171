"""The book: every exercise in exercises/ rendered as static HTML pages. Build it with `./check.sh book`."""

import time

IMPORTED_AT = time.perf_counter()  # `./check.sh book` reports its time including the imports (torch)
