"""The Lightning plugins: the strategy, the precision plugin and the callbacks the strategy installs
(Lightning wiring; the work is done by the layers below)."""
