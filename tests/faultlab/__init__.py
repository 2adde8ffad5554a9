"""The fault lab: hosts as network namespaces (netns.py), a TCP fault proxy for links
(proxy.py), processes on hosts (services.py), a ready world of Redis and relay instances
(world.py), a checker of every accepted message's fate (checker.py), steady traffic
(rmb.py) and the scenarios themselves (scenarios.py), shared by tests/test_faults_*.py and
`python -m bench.faults`. docs/faults.md says what each scenario shows."""
