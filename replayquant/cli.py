from typer import Typer; app = Typer()
