"""Running an untrusted backend outside the verdict's process: its cores in a worker process (client, worker),
on their own copies of the inputs, checked for writes (guard), over pipes in length-prefixed frames of JSON and
safetensors bytes (wire)."""
