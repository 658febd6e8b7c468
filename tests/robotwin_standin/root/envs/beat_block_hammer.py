from ._base_task import Base_Task


class beat_block_hammer(Base_Task):
    def setup_demo(self, **kwags):
        super()._init_task_env_(**kwags)

    def play_once(self):
        self.joints[0] = 0.6  # the stand-in's expert: swing the left arm
        self.info = {"info": {"{A}": "020_hammer/base0", "{a}": "left"}}
        return self.info

    def check_success(self):
        return bool(self.joints[0] > 0.5)
