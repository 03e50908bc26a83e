"""Stand-ins for CUDA streams and events, so the staging pipelines' bookkeeping runs on
machines without a GPU (host memory plays the device's part)."""


class HostStream:
    def __init__(self, *args, **kwargs):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class HostEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass
