"""Live Plotly Dash dashboard of a ResiHP job (the only package that imports dash).

``python -m dashboard`` serves the multi-page app (overview, pipeline timeline,
device skew, failures, plans, incidents) plus Prometheus ``/metrics``;
``python -m dashboard report export`` writes an incident report.
"""
