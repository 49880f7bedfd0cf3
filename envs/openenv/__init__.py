"""OpenEnv environments (``env.type: openenv``): the server (``envs.openenv.server``) and the
task source and episode over openenv-core's client (``envs.openenv.source``)."""
