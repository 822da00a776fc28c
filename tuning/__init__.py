"""The tuner (tune.py, ``qa-tune``): it searches the server's settings for this machine, its
model and its load against a latency objective, every trial a real server start under
bench/'s load (docs/tuning.md).

- ``space``: the settings searched here, as candidate flag sets;
- ``objective``: what a trial must meet, and how trials rank;
- ``trial``: one candidate's real server, loaded and checked;
- ``search``: successive halving under the time budget (and the exhaustive grid);
- ``report``: the trials table, the plot, the winner's command line and settings file.
"""
