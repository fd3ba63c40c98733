"""Trainer back ends for the ResiHP stack: ``sim`` (cluster simulator) and ``torch`` (real training).

Importing this package never imports torch: the torch back end
(``trainer.torch_trainer``) is loaded only when ``python -m trainer torch`` runs.
"""
