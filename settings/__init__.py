"""Settings: what can be configured, with its flags and checks."""

from settings.server_config import ServerConfig, build_parser, config_from_args

__all__ = ["ServerConfig", "build_parser", "config_from_args"]
