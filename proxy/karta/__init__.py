"""The Karta engine: descriptions + cluster objects -> attribution and workload facts.

Pure: no network, no HTTP, no Kubernetes client. Sources (``proxy.snapshot``,
``proxy.kube``) feed it objects; ``proxy.index`` follows the change sets it returns.
"""
