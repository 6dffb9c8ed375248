from .cli import main
from .process import exit_now

exit_now(main())
