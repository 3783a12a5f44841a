"""``delayd top``: a live terminal view of delay servers, read from their /metrics.

``scrape`` fetches and parses a metrics page, ``model`` turns two successive scrapes
into what is shown (rates, lateness percentiles, the wheel, groups), ``render`` draws
it with rich to fit 80x24. ``cluster`` and ``cluster_render`` do the same for a whole
cluster (``delayd top --etcd``), from the groups etcd lists and the views of their
members. The command and its refresh loop are delayd/cli/top.py.
"""

from delayd.top.model import GroupView, Scrape, ServerView, TopModel, server_view
from delayd.top.render import render
from delayd.top.scrape import Snapshot, Target, histogram_quantile, parse_target

__all__ = [
    "GroupView",
    "Scrape",
    "ServerView",
    "Snapshot",
    "Target",
    "TopModel",
    "histogram_quantile",
    "parse_target",
    "render",
    "server_view",
]
