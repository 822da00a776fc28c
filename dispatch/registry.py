"""The setting registry: what each implementation says of the settings it owns, collected in one
place for settings/ to read (settings/choices.py says why settings/ never imports them itself).

The programs that parse the server's settings (server.py, tune.py) take the registry from here,
so that none of them imports another program.
"""

from __future__ import annotations

from broker.urls import config_problems as broker_url_problems
from engines import SETTING_CHOICES as ENGINE_SETTINGS
from scheduling.planner import SETTING_CHOICES as BATCHING_SETTINGS
from settings.choices import SettingRegistry
from transport.tls import config_problems as tls_problems
from workers.cpu_policy import SETTING_CHOICES as CPU_SETTINGS


def setting_registry() -> SettingRegistry:
    """What the implementations say of the settings they own (settings/choices.py): the
    allowed values, and the checks of TLS files and broker URLs."""
    return SettingRegistry(choices={**ENGINE_SETTINGS, **BATCHING_SETTINGS, **CPU_SETTINGS},
                           checks=(tls_problems, broker_url_problems))
