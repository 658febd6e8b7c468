from ._base_task import Base_Task


class lift_pot(Base_Task):
    def setup_demo(self, is_test=False, **kwags):
        super()._init_task_env_(**kwags)

    def play_once(self):
        self.plan_success = self.seed % 2 == 0  # the stand-in's expert fails on odd seeds
        self.joints[0] = self.joints[7] = 0.6
        return {"info": {"{A}": "060_kitchenpot/base0"}}

    def check_success(self):
        return bool(self.joints[7] > 0.5 and self.joints[0] > 0.5)
