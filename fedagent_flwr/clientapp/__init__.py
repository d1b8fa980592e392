"""ClientApp, trainer backends and the TrainJob/TrainResult contract."""
