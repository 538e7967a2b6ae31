"""A task for the launcher's fork server that imports nothing itself: it reports which of the
preloaded modules its process found already imported."""

import sys


def report_preloaded(names, conn) -> None:
    conn.send([name for name in names if name in sys.modules])
    conn.close()
