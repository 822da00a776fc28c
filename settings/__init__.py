"""Settings: what can be configured, with its flags and checks (server_config.py), and the help
format every tool shares (cli.py). Import the modules themselves: cli.py stays light enough for
the client image, which has msgpack alone."""
