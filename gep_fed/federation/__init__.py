"""The federation without Flower: the wire format, a site's policy and trainer, the server's
rounds, aggregation and accounting, and the run directory."""
