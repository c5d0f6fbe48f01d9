"""Moving tokens between ranks: the routing plan on the device, dispatch and combine."""
