"""The tuner (tune.py, ``qa-tune``): it searches the server's settings for this machine, its
model and its load against a latency objective, every trial a real server start under
bench/'s load (docs/tuning.md).

- ``setup``: tune.py's options checked and turned into a plan;
- ``space``: the settings searched here, as candidate flag sets;
- ``objective``: what a trial must meet, and how trials rank;
- ``choice``: the objective where the user gives none: derived from the model alone;
- ``model_alone``: the model's engine alone, in-process and one process per core: the ceiling
  and the reference answers;
- ``trial``: one candidate's real server, loaded and checked;
- ``search``: successive halving under the time budget (and the exhaustive grid);
- ``tuner``: a whole run: the model alone, the probe, the search;
- ``report`` and ``progress``: the trials table, the plot, the winner's command line and
  settings file; the progress bar.
"""
